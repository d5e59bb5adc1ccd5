"""The KVSP services, one package per part (DESIGN.md §1): ``index`` (IS, §6.1-6.2), ``pc``
(Placement Controller, §6.3-6.5, §6.8-6.9), ``holder`` (§6.6-6.7) and ``instance`` (the
inference instance's agent). ``control`` runs IS and PC in one process; ``frontend`` is the
client a request router uses; ``descriptors`` is the descriptor resource every service serves.

A part imports another part only through its package (its public names) or its ``client``
module; ``tests/test_layering.py`` holds the rule.
"""
