"""kimitui theme files (TOML) and their loader. Plain data: no Textual, no engine, no app."""

from themes.loader import ThemeError, ThemeSpec, load_theme_file, load_themes, parse_theme, user_dir

__all__ = ["ThemeError", "ThemeSpec", "load_theme_file", "load_themes", "parse_theme", "user_dir"]
