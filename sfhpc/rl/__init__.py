"""The RL loop: the controller, the rollout and trainer workers, and the messages between them."""
