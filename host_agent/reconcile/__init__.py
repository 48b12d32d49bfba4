"""The reconciler: per ensemble, from the caches to the published state and slices,
level-triggered, on the shared work queue. Which spec is in force is ``spec_io.py``;
the pass itself ``reconcile_io.py``; its pure rules ``reconcile.py``.

May import ensembles/, persist/, ca/, state/, kube/ and the base modules; never
status/ (it hands its Declarations over through a callback) or registry/.
"""
