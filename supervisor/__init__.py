"""unitvisor: a systemd-native host supervisor. The import package is `supervisor`."""

__version__ = "0.11.0"
