"""tether: RLHF fine-tuning that keeps the policy on a visible, controllable KL leash."""

__version__ = "0.1.0"
