"""The workflow's parse-time layer (torch-free): the config checks and the plan every rule reads. Imported by rules/common.smk and the watch command, never by a stage."""
