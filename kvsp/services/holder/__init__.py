"""A block holder (spec §6.6-6.7): blocks by key over HTTP, leases, and the Replica Records it
publishes for what it stores."""
