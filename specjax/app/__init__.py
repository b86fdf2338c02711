"""What the command-line entry points share: flags and exit codes (`cli`), prompts,
where weights come from (`locate`), output files, the sample run and its report."""
