"""The command line resolved once: flags and their Megatron/Rapidformer meanings, the partitioning table, the rules,
and the Plan everything after reads. Nothing here starts a process group or touches a device."""
