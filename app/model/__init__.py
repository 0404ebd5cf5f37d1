"""DeepSeek-V4 / V4.1 modules, config parsing, checkpoint loader."""
