"""fedsplice: personalized federated fine-tuning with split (global / private) adapters."""

__version__ = "0.1.0"
