"""The classifier head over very many classes, as a package: `classifier` (`ParallelClassifierHead`),
`modes` (the groups its classes are split over, the targets it accepts, what its loss is handed),
`fused_ce` and `ce_chunks` (the fused, chunked vocab-parallel cross-entropy and its buffers),
`sampling` (which classes a sampled softmax scores, layout-free), `margin` (ArcFace, CosFace) and
`metrics` (what the fused losses count besides the loss: tokens, correct predictions, z-loss)."""
from .classifier import ParallelClassifierHead
from .fused_ce import fused_cross_entropy
from .metrics import LossMetrics, collect_loss_metrics

__all__ = ["ParallelClassifierHead", "fused_cross_entropy", "collect_loss_metrics", "LossMetrics"]
