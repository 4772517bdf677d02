"""HiCache's page tier on a local disk: page files, their directory and index, TTL expiry."""
