"""Tenants, the calling principal, roles and API keys.

Owns who is calling (`tenants.Principal`, the role checks every caller gets) and the keys that
say so (`keys`: minting, listing, revoking, authenticating; only hashes are stored).

May import the platform's top modules and `eventlog` (its tables). Every package above it scopes
its reads by the principal it defines; the API's authentication calls `keys`.
"""
