"""The trainer: policy-gradient losses (`losses`), the training batch (`batch`), the torch backend
(`torch_trainer`, DDP over gloo via `distributed`) and atomic checkpoints (`checkpoint`)."""
