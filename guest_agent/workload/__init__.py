"""The workload's side of the VM: preflight checks, the readiness barrier, the peer list.

What a CUDA job in the VM needs beyond a formed IMEX domain (docs/guest-agent.md "The
workload's side"): ``preflight`` (checks that catch a broken rack before a job does,
run by the daemon at start and every 10 minutes and by the ``preflight`` command),
``barrier`` (``wait --for local|domain``: when the job may start) and ``members`` (the
peer list from the same source as IMEX).

Each pure half (``preflight.py``, ``barrier.py``) decides from facts it is given; its
``_io`` half gathers them (commands with deadlines, files, the registry, DNS). Imports:
the stages below (report, imex, peers, net, config); never the agent or the commands.
"""
