"""The outer optimizer's defaults, shared by ``periodic`` (DiLoCo, streaming DiLoCo) and ``ps`` (async local SGD).

Both modes step an outer SGD on the averaged (or pushed) pseudo-gradient, with the knobs ``outer_lr``,
``outer_momentum`` and ``outer_nesterov``. Their defaults come from the sweep ``benchmarks/outer_sweep.py`` on
``char_lm`` (2 replicas, 300 and 1000 steps, seeds 0-2) and from the main job's digits workload (the results page's
"Outer optimizer sweep" and "Compare: digits_outer_*" sections; docs/guide/periodic.md says what they show):

- outer momentum 0 (plain outer SGD): on char_lm at H = 8 and 16 every momentum lost to plain outer SGD at the same
  lr but one, and the DiLoCo paper's Nesterov momentum 0.9 lost by 14-32% at every lr; runs of tens to hundreds of
  outer steps spend much of their length in its transient (Khaled et al. 2025: momentum multiplies the effective
  step by ``1 / (1 - momentum)``);
- outer lr :data:`OUTER_LR` with it: it ties DDP on both workloads at H = 8, where lr 0.5 wins on char_lm (-6%) but
  loses on the digits (2 points) and plain averaging (lr 1) loses on char_lm; at H = 16 no outer setting ties DDP on
  char_lm, so the default does not depend on H;
- the DiLoCo paper's setting, Nesterov momentum 0.9 at lr 0.7 (tuned at H = 500 on long runs), is one knob away:
  ``outer_momentum=0.9`` (``outer_nesterov`` is on by default).
"""

from __future__ import annotations

OUTER_LR = 0.7
"""``outer_lr``'s default: plain outer SGD's, and the DiLoCo paper's (there with Nesterov momentum 0.9)."""
PAPER_OUTER_MOMENTUM = 0.9
"""The DiLoCo paper's outer momentum (Nesterov)."""

OUTER_LR_HELP = (
    f"learning rate of the outer SGD, > 0. Default {OUTER_LR}: with the default momentum 0 it ties DDP on char_lm and "
    f"the digits at H = 8 (``benchmarks/outer_sweep.py``); it is also the DiLoCo paper's, so "
    f"``outer_momentum={PAPER_OUTER_MOMENTUM}`` alone gives the paper's setting. ``outer_lr=1`` with momentum 0 is "
    "plain averaging."
)
OUTER_MOMENTUM_HELP = (
    f"momentum of the outer SGD, in [0, 1). Default 0: on char_lm no momentum beat the best plain outer SGD at H = "
    f"8 and 16; {PAPER_OUTER_MOMENTUM} (with ``outer_nesterov``) is the DiLoCo paper's setting, tuned for long runs at "
    "large H."
)
