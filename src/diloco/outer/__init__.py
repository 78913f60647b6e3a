"""Outer optimizers and the rules that merge learners' outer gradients."""

from diloco.outer.delayed_nesterov import DelayedNesterov
from diloco.outer.merge import MERGE_RULES, MergeSums, merge_fragment, radial_directional, weighted_mean
from diloco.outer.nesterov import Nesterov

__all__ = ["Nesterov", "DelayedNesterov", "MERGE_RULES", "MergeSums", "merge_fragment", "radial_directional", "weighted_mean"]
