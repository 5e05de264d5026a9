"""The ledger: usage, quotas and the audit log, kept in one SQLite database that survives restarts.

A leaf below the layers (it imports nothing of edgellmd): the daemon writes it, `edgellmctl
audit` reads and verifies it without the daemon. `store` opens the database and owns its one
writer thread; `usage` holds the records, the quota periods and the queries; `audit` holds the
hash chain and its verification; `seals` seals each hour's usage into the chain and checks it.
"""
