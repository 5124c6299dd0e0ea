"""Fine-tune, then serve: LoRA (peft + transformers' Trainer), merge, Medusa heads, weight quantization, checks,
and a folder `hf-accel serve --model FOLDER` serves (extra `finetune`; see docs/finetune-then-serve.md)."""

from .data import DomainSplits, DomainTexts, domain_splits, text_rows
from .lora import LoraResult, LoraSettings, merge_adapter, train_lora
from .quality import Side, SpeedResult, compare_speed, held_out_perplexity
from .report import report_markdown, report_tables
from ..serving_config import ServingConfig, read_serving_config, write_serving_config
from .stages import FinetuneConfig, run_finetune

__all__ = [
    "DomainSplits", "DomainTexts", "FinetuneConfig", "LoraResult", "LoraSettings", "ServingConfig", "Side",
    "SpeedResult", "compare_speed", "domain_splits", "held_out_perplexity", "merge_adapter", "read_serving_config",
    "report_markdown", "report_tables", "run_finetune", "text_rows", "train_lora", "write_serving_config",
]
