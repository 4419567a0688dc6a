"""Built-in kernel adapters, one file per kernel; torch and flash_attn are imported lazily."""
