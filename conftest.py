"""The checkout's own test session. Options, markers, profiles and GPU skips come from the
installed plugin (attention_crossval/pytest_plugin.py, entry point ``pytest11``), the same one
a user's repository gets; only pytester, for the acceptance tests, is added here."""

pytest_plugins = ["pytester"]
