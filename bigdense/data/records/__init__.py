"""Fine-tuning data as people have it (``data=records``): JSON Lines, Parquet, CSV, Arrow files or a
saved dataset, of texts, prompt/completion pairs or chats; prompts and non-assistant turns masked
from the loss; examples packed into rows.

    data = prepare_records(cfg.data, ctx, seed=cfg.trainer.seed, tokenizer=model_tokenizer(cfg))
    x, y = data.train_batch(step, micro_step)      # y is -100 where a token is not a target

`sources` reads the files, `shapes` checks each record, `encode` tokenises, `rows` cuts rows,
`prepare` caches and serves them.
"""
from .prepare import RecordData, find_or_build, prepare_records
from .rows import IGNORE_INDEX, RowSequence

__all__ = ["prepare_records", "find_or_build", "RecordData", "RowSequence", "IGNORE_INDEX"]
