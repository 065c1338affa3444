"""The outer optimizer's defaults, shared by ``periodic`` (DiLoCo, streaming DiLoCo) and ``ps`` (async local SGD).

Both modes step an outer SGD on the averaged (or pushed) pseudo-gradient, with the knobs ``outer_lr``,
``outer_momentum`` and ``outer_nesterov``. Their defaults come from the sweep ``benchmarks/outer_sweep.py`` on
``char_lm`` (2 replicas, AdamW inside at the model's tuned learning rate, 300 and 1000 steps, seeds 0-2) and from the
main job's digits workload (the results page's "Outer optimizer sweep" and "Compare: digits_outer_*" sections;
docs/guide/periodic.md says what they show):

- outer momentum 0 (plain outer SGD): the DiLoCo paper's Nesterov momentum 0.9 lost by 37-40% at 300 steps, and
  momentum 0.5 lost to no momentum at 300 steps and was no better at 1000, with a wider spread over seeds (its
  transient is much of a run of 19 to 125 outer steps; Khaled et al. 2025: momentum multiplies the effective step
  by ``1 / (1 - momentum)``);
- outer lr :data:`OUTER_LR` with it: lr 0.7 and plain averaging (lr 1) are the best of the sweep; their seed ranges
  overlap at three of its four points (H = 8 and 16, 300 and 1000 steps), and at 300 steps and H = 8 plain averaging
  ends 2% lower. Both tie DDP on the digits at H = 8. lr 0.5 and lr above 1 lose clearly. lr 0.7 is the default
  because it keeps the DiLoCo paper's setting one knob away; the default does not depend on H;
- no outer setting ties DDP on char_lm at equal steps (2 replicas; 5-12% above DDP's test loss after 300 steps,
  2-5% after 1000): the gap is the period's, and it shrinks as the run grows;
- the DiLoCo paper's setting, Nesterov momentum 0.9 at lr 0.7 (tuned at H = 500 on long runs), is one knob away:
  ``outer_momentum=0.9`` (``outer_nesterov`` is on by default).
"""

from __future__ import annotations

OUTER_LR = 0.7
"""``outer_lr``'s default: plain outer SGD's, and the DiLoCo paper's (there with Nesterov momentum 0.9)."""
PAPER_OUTER_MOMENTUM = 0.9
"""The DiLoCo paper's outer momentum (Nesterov)."""

OUTER_LR_HELP = (
    f"learning rate of the outer SGD, > 0. Default {OUTER_LR}: with the default momentum 0, among the best of "
    f"``benchmarks/outer_sweep.py`` on char_lm at H = 8 and 16, and a tie with DDP on the digits at H = 8; it is also "
    f"the DiLoCo paper's, so "
    f"``outer_momentum={PAPER_OUTER_MOMENTUM}`` alone gives the paper's setting. ``outer_lr=1`` with momentum 0 is "
    "plain averaging."
)
OUTER_MOMENTUM_HELP = (
    f"momentum of the outer SGD, in [0, 1). Default 0: on char_lm over runs of tens of outer steps momentum lost to "
    f"plain outer SGD at H = 8 and 16; {PAPER_OUTER_MOMENTUM} (with ``outer_nesterov``) is the DiLoCo paper's setting, "
    "tuned for long runs at large H."
)
