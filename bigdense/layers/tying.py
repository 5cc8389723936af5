"""Tied input/output embeddings: one Parameter shared by a VocabParallelEmbedding and a classifier head."""
from __future__ import annotations


def tie_weights(embedding, head: ParallelClassifierHead) -> ParallelClassifierHead:
    """Make ``head.weight`` the same Parameter as ``embedding.weight`` (tied input/output embeddings).

    Both are split by row with the same balanced rule, so with ``num_classes == num_embeddings``,
    ``in_features == embedding_dim`` and the same TP group each rank's shards line up and the
    gradients of both uses accumulate into the one local shard. The embedding initialises the
    weight; ``head.reset_parameters()`` (and so `bigdense.materialize`, whose ``to_empty`` unties
    Parameters) re-ties instead of re-initialising. Returns ``head``.
    """
    from .embedding import VocabParallelEmbedding
    from .head import ParallelClassifierHead

    if not isinstance(embedding, VocabParallelEmbedding) or not isinstance(head, ParallelClassifierHead):
        raise TypeError(
            f"tie_weights(embedding, head): expected a VocabParallelEmbedding and a ParallelClassifierHead, "
            f"got {type(embedding).__name__} and {type(head).__name__}"
        )
    if (embedding.num_embeddings, embedding.embedding_dim) != (head.num_classes, head.in_features):
        raise ValueError(
            f"tie_weights: the embedding is ({embedding.num_embeddings}, {embedding.embedding_dim}) but the head "
            f"needs (num_classes, in_features) = ({head.num_classes}, {head.in_features})"
        )
    if embedding.tp_group is not head.tp_group:
        raise ValueError(
            "tie_weights: the embedding and the head use different TP groups; their shards would not line up"
        )
    if embedding.weight.dtype != head.weight.dtype or embedding.weight.device != head.weight.device:
        raise ValueError(
            f"tie_weights: embedding weight is {embedding.weight.dtype} on {embedding.weight.device}, "
            f"head weight {head.weight.dtype} on {head.weight.device}"
        )
    head._tied_embedding = (embedding,)  # a tuple: not registered as a submodule of the head
    head.weight = embedding.weight
    return head
