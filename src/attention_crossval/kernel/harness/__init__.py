"""The harness that runs a kernel under the contract: checks, isolation, references, verdicts."""
