"""What a job does with a configuration (floor 6): start a run (`setup`), build its model from the
config (`models`), apply parallelism to it in one fixed order (`parallelize`), and run it with the
error handling both launchers share (`run`). `launch/train.py` and `launch/classify.py` read top to
bottom on these; so do `python -m bigdense.compress` and the memory planner's measurement.
"""
from .models import build_gpt, build_hf, build_text_classifier, model_tokenizer
from .parallelize import Parallelized, parallelize_model
from .setup import Run, start_run

__all__ = ["build_gpt", "build_hf", "model_tokenizer", "build_text_classifier", "Parallelized", "parallelize_model", "Run", "start_run"]
