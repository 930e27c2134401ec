"""Test support: real servers and emulators the tests start on 127.0.0.1."""
