"""The MOQT relay that caches KV block tracks and acts as a KVSP holder (DESIGN.md §1, §4)."""
