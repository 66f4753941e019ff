"""Integrations with other libraries, each in its own module and imported on demand.

- ringattn.integrations.hf: Hugging Face transformers (extra `hf`): ring attention as an attention
  implementation named "ringattn".
"""
