"""The state behind the Index Service, the PC and the holders (DESIGN.md §1, §2 ``stores/``).

Replica, session and Shard Map stores in memory or in a shared Redis, the holder's tiered block
store and the Compatibility Descriptor registry. Each store is narrow, so that every rule of the
core is applied in one call (one Lua script on Redis); nothing here knows the web stack.
"""
