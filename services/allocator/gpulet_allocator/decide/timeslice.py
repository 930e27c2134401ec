"""The decision core's time-slicing: the config in force, applied to the ledger.

The node label's value (read by :mod:`gpulet_allocator.service.node_label`, handed in
through :meth:`TimeSlicing.select`) picks a config of ``sharing.time_slicing`` (its
``configs``, and those of ``configs_file``, handed in through
:meth:`TimeSlicing.set_file_configs` whenever the file changes); the
replicas each GPU gets (:func:`gpulet_allocator.timeslicing.plan`) go into the ledger
(:meth:`~gpulet_allocator.decide.engine.Ledger.set_replicas`), again on every new
inventory. Nothing held is taken back (the rules: :mod:`gpulet_allocator.timeslicing`).
Until the label was read, the default config applies.

Synchronous, no I/O; one event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import msgspec

from gpulet_allocator.decide.books import Books
from gpulet_allocator.timeslicing import TimeSlicePlan, chosen_config, plan
from gpulet_common.settings.sharing import TimeSlicingConfig, TimeSlicingSettings

log = logging.getLogger("gpulet.allocator")


class TimeSlicing:
    """The time-slicing config in force and its plan (see the module docstring)."""

    def __init__(self, books: Books, settings: TimeSlicingSettings, gpu_resource: str) -> None:
        self._books = books
        self._base = settings
        self._settings = settings
        # The label's value last seen (None: no label, or not read yet).
        self._label: str | None = None
        self._gpu_resource = gpu_resource
        self.config, self.problem = chosen_config(settings, None)
        # The definition of the config in force (kept if its name leaves the configs).
        self._chosen = settings.configs.get(self.config)
        #: The plan in force: the replicas of each time-sliced GPU.
        self.plan = TimeSlicePlan()

    def select(self, label: str | None) -> bool:
        """The node label's value now (None: no label); returns whether the plan changed.

        A label naming no config keeps the config in force and says why (``problem``).
        """
        self._label = label
        config, problem = chosen_config(self._settings, label)
        if problem:
            if problem != self.problem:
                log.warning("time-slicing: %s; keeping config %r", problem, self.config)
            self.problem = problem
            return False
        self.problem = ""
        if config != self.config:
            log.info("time-slicing: config %r now (was %r)", config, self.config)
        self.config = config
        self._chosen = self._settings.configs.get(config)
        return self.apply()

    def set_file_configs(self, configs: Mapping[str, TimeSlicingConfig]) -> bool:
        """The configs of ``configs_file`` now (they win over the settings' of the same
        name); the label is judged again against them. True when the plan changed."""
        merged = {**self._base.configs, **configs}
        if merged == self._settings.configs:
            return False
        self._settings = msgspec.structs.replace(self._settings, configs=merged)
        log.info("time-slicing: configs now %s", ", ".join(sorted(merged)) or "none")
        return self.select(self._label)

    def apply(self) -> bool:
        """Plan the config in force for the inventory, into the ledger; True on a change."""
        inventory = self._books.inventory
        gpus = inventory.gpus if inventory is not None else []
        new = plan(self.config, self._chosen, gpus, self._gpu_resource)
        for problem in set(new.problems) - set(self.plan.problems):
            log.warning("time-slicing: %s", problem)
        changed = new != self.plan
        self.plan = new
        self._books.ledger.set_replicas(
            new.replicas, fail_over_one=new.fail_requests_greater_than_one
        )
        return changed

    def replicas(self) -> dict[str, int]:
        """The replicas of each time-sliced GPU (the device plugin lists them)."""
        return dict(self.plan.replicas)
