"""Integrations with other libraries, each in its own module and imported on demand.

- ringattn.integrations.hf: Hugging Face transformers (extra `hf`): ring attention as an attention
  implementation named "ringattn".
- ringattn.integrations.trainer: transformers.Trainer (extra `hf`: transformers and accelerate): RingTrainer,
  sequences split over rings of ranks and data parallelism across the rings.
"""
