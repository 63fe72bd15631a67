"""Rollout: agents that play task episodes against the policy through the agent endpoint."""
