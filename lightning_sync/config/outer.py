"""The outer optimizer's defaults, shared by ``periodic`` (DiLoCo, streaming DiLoCo) and ``ps`` (async local SGD).

Both modes step an outer SGD on the averaged (or pushed) pseudo-gradient, with the knobs ``outer_lr``,
``outer_momentum`` and ``outer_nesterov``. Their defaults come from the sweep ``benchmarks/outer_sweep.py`` on
``char_lm`` (2 replicas, 300 and 1000 steps, seeds 0-2; the results page's "Outer optimizer sweep" sections):

- outer momentum 0 (plain outer SGD): at H = 8 and 16, every momentum lost to plain outer SGD at the same lr but
  one (lr 0.3 with momentum 0.5 at H = 8, whose effective step, ``lr / (1 - momentum)`` = 0.6, is near the best
  one's), and the DiLoCo paper's Nesterov momentum 0.9 lost by 14-32% at every lr; runs of a few hundred outer
  steps spend much of their length in its transient (Khaled et al. 2025: momentum multiplies the effective step by
  ``1 / (1 - momentum)``);
- outer lr :data:`SGD_OUTER_LR` with it, at every period: the best at H = 8 at 300 and 1000 steps, and within the
  seeds' spread of the best at H = 16. The sweep found no rule in H worth the complexity (the best lr at H = 16 was
  0.3 at 300 steps and 0.5 at 1000), and ran 2 replicas only, so the default does not depend on the replica count
  (Charles et al. 2025 found the best outer lr rising with it, with Nesterov momentum);
- not a win everywhere: on the digits classifier (``experiment=diloco``, 15 outer steps) the default ends about 2
  points of accuracy below DDP, where lr 1 without momentum and the paper's setting tie with it; on a run that
  short, whose loss still falls fast, an outer lr below 1 slows it down;
- the DiLoCo paper's setting, Nesterov momentum 0.9 at lr 0.7 (tuned at H = 500 on long runs), is one knob away:
  ``outer_momentum=0.9`` (``outer_lr`` left at its default then resolves to :data:`PAPER_OUTER_LR`, and
  ``outer_nesterov`` is on by default).
"""

from __future__ import annotations

from typing import Any

from lightning_sync.errors import ConfigError

SGD_OUTER_LR = 0.5
"""``outer_lr``'s default without outer momentum: the sweep's pick."""
PAPER_OUTER_LR = 0.7
"""``outer_lr``'s default with outer momentum: the DiLoCo paper's (with Nesterov momentum 0.9)."""
PAPER_OUTER_MOMENTUM = 0.9
"""The DiLoCo paper's outer momentum (Nesterov)."""

OUTER_LR_HELP = (
    f"learning rate of the outer SGD, > 0; ``None`` (default): {SGD_OUTER_LR} without outer momentum (the "
    f"sweep's pick on char_lm at H = 8 and 16, ``benchmarks/outer_sweep.py``), {PAPER_OUTER_LR} with it (the DiLoCo "
    f"paper's). ``outer_momentum={PAPER_OUTER_MOMENTUM}`` alone gives the paper's setting (Nesterov, lr "
    f"{PAPER_OUTER_LR}, momentum {PAPER_OUTER_MOMENTUM}); ``outer_lr=1`` with momentum 0 is plain averaging."
)
OUTER_MOMENTUM_HELP = (
    f"momentum of the outer SGD, in [0, 1). Default 0: on char_lm no momentum beat the best plain outer SGD at H = "
    f"8 and 16; {PAPER_OUTER_MOMENTUM} (with ``outer_nesterov`` and the default ``outer_lr``) is the DiLoCo paper's "
    "setting, tuned for long runs at large H."
)


def default_outer_lr(outer_momentum: Any) -> float:
    """The outer learning rate an ``outer_lr`` of ``None`` resolves to: :data:`SGD_OUTER_LR` without outer momentum,
    :data:`PAPER_OUTER_LR` with it.

    Raises:
        ConfigError: ``outer_momentum`` is not a number in [0, 1) (naming the field, the value and what is allowed).
    """
    number = isinstance(outer_momentum, (int, float)) and not isinstance(outer_momentum, bool)
    if not number or not 0 <= outer_momentum < 1:
        raise ConfigError(f"outer_momentum={outer_momentum!r} is not allowed; it must be a number in [0, 1)")
    return SGD_OUTER_LR if outer_momentum == 0 else PAPER_OUTER_LR
