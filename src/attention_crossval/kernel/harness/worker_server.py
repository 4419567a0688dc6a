"""Imported first by the fork server that kernel workers are forked from
(``kernel.harness.isolation._worker_context``): the server then dies with the process that started
it
(Linux ``PR_SET_PDEATHSIG``), and with it, by the same signal, every worker forked from it, even
one hung in native code. Without this the server would outlive a killed caller: each worker
holds the pipe end whose closing tells the server its caller is gone."""

from attention_crossval.kernel.harness.isolation import die_with_parent_process

die_with_parent_process()
