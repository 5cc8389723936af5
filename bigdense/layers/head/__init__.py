"""The classifier head over very many classes, as a package: `classifier` (`ParallelClassifierHead`),
`modes` (the groups its classes are split over, the targets it accepts, what its loss is handed),
`fused_ce` and `ce_chunks` (the fused, chunked vocab-parallel cross-entropy and its buffers),
`sampling` (which classes a sampled softmax scores, layout-free) and `margin` (ArcFace, CosFace)."""
from .classifier import ParallelClassifierHead

__all__ = ["ParallelClassifierHead"]
