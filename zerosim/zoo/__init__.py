"""``zerosim zoo``: silent-correctness bugs from public reports, reproduced small, and what catches them.

:mod:`~zerosim.zoo.catalogue` (the entries, as data), :mod:`~zerosim.zoo.trainer` (the correct sharded
trainer), :mod:`~zerosim.zoo.bugs` (each mechanism on it, with its fixed twin), :mod:`~zerosim.zoo.live`
(the same mechanisms in a monitored training loop), :mod:`~zerosim.zoo.runner` (verify and the monitor
on every entry) and :mod:`~zerosim.zoo.report` (the report).
"""
