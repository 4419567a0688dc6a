"""The checkout's own test session: the package's pytest plugin (options, markers, profiles, GPU
skips: the same one a user's repository gets through its ``pytest11`` entry point, named here
too so that a checkout on PYTHONPATH works uninstalled) and pytester for the acceptance tests."""

pytest_plugins = ["pytester", "attention_crossval.pytest_plugin"]
