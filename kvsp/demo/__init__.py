"""The one-command demo and local operations: ``kvsp demo``, ``kvsp up``, ``kvsp status``
(DESIGN.md §1: the parts and how they talk, run as real processes on loopback).

* :mod:`kvsp.demo.procs` starts services as subprocesses in one process group that dies with
  the parent, and waits for their ready files;
* :mod:`kvsp.demo.cluster` fills the state folder (:mod:`kvsp.demo.state`: seeded model,
  principals, tokens, scope key) and starts the control plane, a MOQT relay and
  reference-engine instances;
* :mod:`kvsp.demo.client` is the demo's HTTP client of the PC, the IS and the instances;
* :mod:`kvsp.demo.scenario`, :mod:`kvsp.demo.moqt_step` and :mod:`kvsp.demo.failover` play
  the scenario; :mod:`kvsp.demo.summary` prints its report;
* :mod:`kvsp.demo.status` prints a running cluster's tables; :mod:`kvsp.demo.console` draws
  progress bars and tables; :mod:`kvsp.demo.cli` adds the subcommands.

Nothing here is imported by the protocol core or the services.
"""
