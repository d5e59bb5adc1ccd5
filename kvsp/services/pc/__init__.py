"""The Placement Controller (spec §6.3-6.5, §6.8-6.9): instance status and lifecycle,
placement, prefetch directives, session checkpoints and resume, shard maps and resharding."""
