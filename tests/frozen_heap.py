"""Imported last by the fork server of test ranks and forked ``cli.py`` commands
(:data:`tl_testing.FORK_PRELOAD`): one collection, then every object the server's imports made
moves to the garbage collector's permanent generation (:func:`gc.freeze`, Python's advice before
forking). A forked process's collections then skip those objects: its first full collection
(the run's, ``ManualGC``) otherwise visits the preloaded heap of torch and the run and writes
each object's header, copying every page of it out of the shared copy-on-write memory (about
0.2 s of CPU and 80 MB per process on a slow 2-core machine)."""

import gc

gc.collect()
gc.freeze()
