pytest_plugins = ["torchdist_ext.testing.pytest_fixtures"]
