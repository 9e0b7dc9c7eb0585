"""What a person sees on a terminal: progress bars and log lines."""
