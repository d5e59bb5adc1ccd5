"""The Index Service (spec §6.1-6.2): replica records, prefix lookup, estimates."""
