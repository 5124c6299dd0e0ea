"""Training: the reference models, Medusa and EAGLE heads, and LoRA fine-tuning, with what they share.

Shared: `data.py` (training rows and batch orders), `options.py` (the options every training command takes),
`train_loop.py` (the head trainers' loop: optimizer, schedule, steps, progress, checkpoints).
- Medusa heads: `medusa_trainer.py` (`train_medusa`), `medusa_calibration.py` (accuracy, candidate tree),
  `medusa_command.py` (`hf-accel train-medusa`).
- EAGLE heads: `eagle_trainer.py` (`train_eagle`), `eagle_features.py` (the frozen target's features),
  `eagle_unroll.py` (the training-time test), `eagle_command.py` (`hf-accel train-eagle`).
- Fine-tune, then serve (extra `finetune`): `lora.py` (peft + transformers' Trainer), `finetune_domain.py` (the
  domain text), `finetune.py` (`run_finetune`, every stage), `finetune_quality.py` (perplexity, speed),
  `finetune_report.py` (tables), `finetune_command.py` (`hf-accel finetune`).
- Reference models: `reference_presets.py` (shapes, recipes), `reference_tokenizer.py`, `reference_trainer.py`
  (`train_model`), `depth_growth.py`, `reference_build.py` (the pipeline to report.json), `reference_command.py`
  (`hf-accel train-reference`). The shipped models and their loading stay in `hf_accel.reference`.

Nothing is imported here: `import hf_accel` loads only the trainers it exports, and the fine-tune modules need peft.
"""
