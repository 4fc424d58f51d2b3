"""RL fine-tuning of language models as roles (issue 52): rollout, store and trainer; README.md says how far it is."""
