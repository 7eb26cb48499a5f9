"""The security tests use the session-scoped `secure` fixture of tests/conftest.py: the API in
process on a database of its own (tests/secure_app.py)."""
