"""kimitui theme files (TOML) and their loader. Plain data: no Textual, no engine, no app."""

from kimitui._source_tree import with_folder

__path__ = with_folder(__path__, "themes", "loader.py")  # the modules: the top-level themes/ folder

from kimitui.themes.loader import ThemeError, ThemeSpec, load_theme_file, load_themes, parse_theme, user_dir

__all__ = ["ThemeError", "ThemeSpec", "load_theme_file", "load_themes", "parse_theme", "user_dir"]
