"""The settings of one run that each rank's executor reads: one typed field each, picklable with the payload."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..host import HostSettings

__all__ = ["RunSettings"]


@dataclass
class RunSettings:
    """What ``Program.payload`` hands every rank besides its graphs and state (``RankPayload.settings``)."""
    n_inputs: int = 0                    # batch columns that are model inputs (the rest are targets)
    rng_seed: int | None = None          # the rank's random streams' seed (runtime.groups.seed_rank); None: as they are
    record_weights: bool = False         # log a fingerprint of the weights every F and B computes with
    measure_comm: bool = False           # record every collective the rank runs
    measure_memory: bool = False         # record the most tensor bytes alive at once, per window
    aliases: dict = field(default_factory=dict)     # tied parameter key -> the key its storage is saved under
    save_to: str | None = None           # checkpoint written after the last step
    resume_from: str | None = None       # checkpoint loaded before the first step
    asynchronous: bool = False           # an asynchronous schedule: one window over all batches (run_async)
    resumed: bool = False                # an asynchronous window that starts from a checkpoint's carried versions
    carried: dict = field(default_factory=dict)     # stage -> weight versions before the newest a checkpoint carries
    reduced_by: dict = field(default_factory=dict)  # stage -> {tied key: the held stage that reduces it here}
    host: HostSettings = field(default_factory=HostSettings)   # the ClusterSpec's settings for this process
    slowdown: float = 1.0                # ClusterSpec.slowdown: this rank's compute made that many times as long
