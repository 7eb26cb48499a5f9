"""Checkpoints and the object store that holds their files.

Owns `tinker://` paths, names and the versioned registry (`checkpoints`), the platform's own
recovery points (`auto_checkpoints`), download links (`checkpoint_links`), copies into another
run (`copies`), publishing to other tenants (`publishing`), age encryption of exported weights
(`age_encryption`) and the storage backends, a local directory or S3 (`storage`).

May import the platform's top modules, `eventlog`, `tenancy` and `sessions`. Called by
`serving`, the API and the workers (which write and read the files).
"""
