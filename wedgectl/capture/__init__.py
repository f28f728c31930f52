"""From a pid or URL to evidence: discovery of a deployment, the sampler and its escalation policy, the live session."""
