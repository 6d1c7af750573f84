"""The parser of the commands that start an engine, generated from the declarations.

`add_engine_arguments` adds every declared vLLM argument (aioserve.config.arguments) to a
parser, in one group per vLLM config group, with `--help` text and defaults taken from the
declarations. `build_engine_parser` is the parser of `serve` and of the engine benchmarks:
those arguments, the positional `model_tag` (the same as `--model`), and `--config
FILE.yaml`. Its class, EngineArgumentParser, adds vLLM's syntax on top of argparse:

- JSON arguments also take their keys one by one: `--hf-overrides.a.b 1` sets
  {"a": {"b": 1}}, `--hf-overrides.a+ x,y` appends "x" and "y" to the list at "a". Values
  are read as JSON when they parse, else as strings; the keys merge into the value given
  in full (`--hf-overrides '{...}'`), whatever the order.
- `-O` is vLLM 0.32's alias of `--optimization-level` (`-O3`, `-O=3`, `-O 3`); with a
  JSON object or a dotted key (`-O.level=0`) it sets `--compilation-config`, as in the
  older vLLM (config/optimization.py).
- `--config FILE.yaml` reads options from a YAML mapping whose keys are long option names
  without dashes, in snake or kebab case; options on the command line win, and options that
  may be repeated add to the file's values.
- `--help=<group>`, `--help=<argument>`, `--help=<keyword>` and `--help=listgroup` show
  part of the help.

The parser converts nothing: values stay strings (or lists, bools, decoded JSON) and an
attribute is set only for an argument given, which is how unsupported arguments are
detected; `engine.py` and `frontend.py` check and convert them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from aioserve.config.arguments import ARGUMENTS, argument
from aioserve.config.declaration import FRONTEND, GROUP_DESCRIPTIONS, Argument
from aioserve.config.optimization import compilation_config_dash_o


class JsonArgumentAction(argparse.Action):
    """Stores the decoded JSON value of a JSON argument.

    The dotted form (`--hf-overrides.a.b 1`) is expanded by EngineArgumentParser, which
    finds the JSON arguments through this class.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = json.loads(values)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentError(self, f"not valid JSON: {values!r} ({error})") from None
        setattr(namespace, self.dest, value)


UNSUPPORTED_GROUP_TITLE = "vLLM arguments that aioserve does not support yet"


def _help(argument: Argument, default: Any) -> str:
    if argument.supported:
        text = argument.help
        if default not in (None, {}):
            text += f" (default: {default})"
    else:
        status = "refused" if argument.why else "not supported yet"
        text = f"[{argument.group}, {status}] {argument.help}"
    return text.replace("%", "%%")  # argparse formats help strings with %


def _metavar(argument: Argument) -> str | None:
    if argument.metavar is not None:
        return argument.metavar
    if argument.choices:
        return "{" + ",".join(str(choice) for choice in argument.choices) + "}"
    if argument.kind == "json":
        return "JSON"
    return None


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    *,
    frontend: bool = True,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add every declared vLLM argument to `parser`.

    Supported arguments go in one group per vLLM config group; the others in a final group
    titled UNSUPPORTED_GROUP_TITLE. No argument gets a default in the namespace: an
    attribute is present only when the user set it, which is how unsupported arguments are
    detected; `engine_config_from_args` and `frontend_config_from_args` fill in the declared
    defaults, which the help shows. With `frontend=False` the HTTP-server arguments are left
    out (for `bench`, which has no server). `defaults` (by dest) replaces declared defaults
    for this command: they are put in the namespace, and the help shows them.
    """
    defaults = defaults or {}
    declared = [a for a in ARGUMENTS if frontend or a.group != FRONTEND]
    groups: dict[str, Any] = {}
    for group in dict.fromkeys(a.group for a in declared if a.supported):
        groups[group] = parser.add_argument_group(group, GROUP_DESCRIPTIONS[group])
    unsupported = parser.add_argument_group(
        UNSUPPORTED_GROUP_TITLE,
        "aioserve knows these vLLM arguments and refuses to start when one is set.",
    )
    for arg in declared:
        target = groups[arg.group] if arg.supported else unsupported
        options: dict[str, Any] = {
            "dest": arg.dest,
            "default": defaults.get(arg.dest, argparse.SUPPRESS),
            "help": _help(arg, defaults.get(arg.dest, arg.default)),
        }
        if arg.kind == "flag":
            options["action"] = "store_true"
        elif arg.kind == "bool":
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["metavar"] = _metavar(arg)
            if arg.kind == "json":
                options["action"] = JsonArgumentAction
            elif arg.kind == "list":
                options["nargs"] = "+"
            elif arg.kind == "append":
                options["action"] = "append"
            elif arg.kind == "optional":
                options["nargs"] = "?"
                options["const"] = True
        target.add_argument(arg.flag, *arg.aliases, **options)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """Merge `update` into `into`: nested objects merge, lists extend, anything else replaces."""
    for key, value in update.items():
        old = into.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            _merge(old, value)
        elif isinstance(old, list) and isinstance(value, list):
            old.extend(value)
        else:
            into[key] = value


class EngineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that also reads vLLM's dotted JSON keys, `-O`, `--config` and
    `--help=`.

    Each feature applies only when the parser has what it needs (JSON arguments, a
    `--config` option, a `model_tag` positional), so a parser without them behaves like a
    plain ArgumentParser. Prefix abbreviations of long options are off, as in vLLM.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        tokens = list(sys.argv[1:] if args is None else args)
        for token in tokens:
            if token == "--":
                break
            # A parser with subcommands (`bench`) leaves `--help=` to the subcommand's parser.
            if token.startswith("--help=") and self._subparsers is None:
                self._print_part_of_help(token.removeprefix("--help="))
        if "--compilation-config" in self._option_string_actions:
            tokens = compilation_config_dash_o(tokens)
        tokens, dotted = self._pull_dotted_json(tokens)
        namespace = argparse.Namespace() if namespace is None else namespace
        model_from_file = None
        config_path = self._config_path(tokens)
        if config_path is not None:
            from_file = self._parse_config_file(config_path)
            # The file's model yields to a positional model_tag as well as to --model.
            model_from_file = from_file.pop("model", None)
            for dest, value in from_file.items():
                if not hasattr(namespace, dest):
                    setattr(namespace, dest, value)
        namespace, extras = super().parse_known_args(tokens, namespace)
        for action, update in dotted.values():
            base = getattr(namespace, action.dest, {})
            if not isinstance(base, dict):
                self.error(
                    f"argument {'/'.join(action.option_strings)}: cannot set keys of the "
                    f"non-object value {base!r}"
                )
            merged = copy.deepcopy(base)
            _merge(merged, update)
            setattr(namespace, action.dest, merged)
        self._settle_model(namespace, model_from_file)
        return namespace, extras

    # --- dotted JSON keys --------------------------------------------------------------

    def _pull_dotted_json(
        self, tokens: list[str]
    ) -> tuple[list[str], dict[str, tuple[argparse.Action, dict[str, Any]]]]:
        """Take `--x.key value` / `--x.key=value` out of `tokens`, merged per argument."""
        json_actions = {
            option: action
            for action in self._actions
            if isinstance(action, JsonArgumentAction)
            for option in action.option_strings
        }
        rest: list[str] = []
        dotted: dict[str, tuple[argparse.Action, dict[str, Any]]] = {}
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token == "--":
                rest.extend(tokens[i:])
                break
            option, has_value, value = token.partition("=")
            head, _, path = option.partition(".")
            if not (token.startswith("-") and path and head in json_actions):
                rest.append(token)
                i += 1
                continue
            if not has_value:
                if i + 1 == len(tokens):
                    self.error(f"argument {option}: expected a value")
                i += 1
                value = tokens[i]
            keys = path.split(".")
            appending = keys[-1].endswith("+")
            if appending:
                keys[-1] = keys[-1][:-1]
            if not all(keys):
                self.error(f"argument {option}: empty key")
            leaf = (
                [_json_or_text(v) for v in value.split(",")] if appending else _json_or_text(value)
            )
            for key in reversed(keys):
                leaf = {key: leaf}
            action = json_actions[head]
            _merge(dotted.setdefault(action.dest, (action, {}))[1], leaf)
            i += 1
        return rest, dotted

    # --- --config FILE.yaml -------------------------------------------------------------

    def _config_path(self, tokens: list[str]) -> str | None:
        if "--config" not in self._option_string_actions:
            return None
        path = None
        for i, token in enumerate(tokens):
            if token == "--":
                break
            if token == "--config" and i + 1 < len(tokens):
                path = tokens[i + 1]
            elif token.startswith("--config="):
                path = token.removeprefix("--config=")
        return path

    def _parse_config_file(self, path: str) -> dict[str, Any]:
        """The options a YAML file sets, parsed as if they were on the command line."""
        import yaml

        try:
            with open(path, encoding="utf-8") as file:
                data = yaml.safe_load(file)
        except OSError as error:
            self.error(f"--config: cannot read {path!r}: {error.strerror}")
        except yaml.YAMLError as error:
            self.error(f"--config: {path!r} is not valid YAML: {error}")
        if data is None:
            data = {}
        if not isinstance(data, dict):
            self.error(f"--config: {path!r} must hold a mapping of option names to values")
        tokens: list[str] = []
        for key, value in data.items():
            option = "--" + str(key).replace("_", "-")
            action = self._option_string_actions.get(option)
            if action is None or option in ("--config", "--help"):
                self.error(f"--config: {path!r} sets {key!r}, which is not an option")
            if value is not None:
                tokens += self._config_value_tokens(path, key, option, action, value)
        namespace, extras = super().parse_known_args(tokens, argparse.Namespace())
        if extras:
            self.error(f"--config: {path!r}: cannot use {' '.join(extras)}")
        return vars(namespace)

    def _config_value_tokens(
        self, path: str, key: str, option: str, action: argparse.Action, value: Any
    ) -> list[str]:
        def text(item: Any) -> str:
            return json.dumps(item) if isinstance(item, (dict, list)) else str(item)

        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                self.error(f"--config: {path!r}: {key} must be true or false, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                return [option if value else "--no-" + option.removeprefix("--")]
            return [option] if value else []
        if action.nargs == "?" and value is True:
            return [option]
        if isinstance(action, JsonArgumentAction):
            return [option, value if isinstance(value, str) else json.dumps(value)]
        if isinstance(action, argparse._AppendAction):
            items = value if isinstance(value, list) else [value]
            return [token for item in items for token in (option, text(item))]
        if action.nargs == "+" and isinstance(value, list):
            return [option, *map(text, value)]
        return [option, text(value)]

    # --- model_tag and --model ----------------------------------------------------------

    def _settle_model(self, namespace: argparse.Namespace, model_from_file: Any) -> None:
        """`model_tag` is `--model` given positionally; both at once must agree."""
        tag = getattr(namespace, "model_tag", None)
        if tag is not None:
            if hasattr(namespace, "model") and namespace.model != tag:
                self.error(
                    f"the model is given twice, as {tag!r} and as --model "
                    f"{namespace.model!r}; give it once"
                )
            namespace.model = tag
        elif model_from_file is not None and not hasattr(namespace, "model"):
            namespace.model = model_from_file

    # --- --help=<...> -------------------------------------------------------------------

    def _print_part_of_help(self, keyword: str) -> NoReturn:
        """vLLM's `--help=<group|argument|keyword|listgroup>`."""
        wanted = keyword.strip().lower()
        # Each action belongs to its argparse group and, for a declared argument, to its
        # vLLM group (unsupported arguments share one argparse group).
        sections: dict[str, tuple[str, list[argparse.Action]]] = {}
        for group in self._action_groups:
            for action in group._group_actions:
                declared = argument(action.dest)
                for title in dict.fromkeys([group.title, declared.group if declared else None]):
                    if title:
                        description = GROUP_DESCRIPTIONS.get(title, group.description or "")
                        sections.setdefault(title, (description, []))[1].append(action)
        if wanted == "listgroup":
            lines = [
                f"  {title}: {description}" if description else f"  {title}"
                for title, (description, _) in sections.items()
            ]
            self._show(
                "Argument groups (show one with --help=<group>):\n" + "\n".join(lines) + "\n"
            )
        formatter = self._get_formatter()
        for title, (description, actions) in sections.items():
            if title.lower() == wanted:
                formatter.start_section(title)
                formatter.add_text(description)
                formatter.add_arguments(actions)
                formatter.end_section()
                self._show(formatter.format_help())
        name = "--" + wanted.lstrip("-")
        exact = [a for a in self._actions if name in a.option_strings]
        matching = exact or [
            a for a in self._actions if any(wanted in o.lower() for o in a.option_strings)
        ]
        if not matching:
            self.exit(1, f"No group or argument matches {keyword!r}; try --help=listgroup\n")
        formatter.start_section(f"arguments matching {keyword!r}")
        formatter.add_arguments(matching)
        formatter.end_section()
        self._show(formatter.format_help())

    def _show(self, text: str) -> NoReturn:
        sys.stdout.write(text)
        self.exit(0)


def build_engine_parser(
    prog: str, *, frontend: bool = True, defaults: dict[str, Any] | None = None
) -> EngineArgumentParser:
    """The parser of a command that starts an engine: `model_tag`, `--config`, every vLLM argument.

    With `frontend=False` the HTTP server's arguments are left out (for `bench`); `defaults`
    are the command's own defaults for some of them (see add_engine_arguments).
    """
    parser = EngineArgumentParser(
        prog=prog,
        usage=f"{prog} [model_tag] [options]",
        epilog=(
            f"Show part of this help with {prog} --help=<group> (e.g. ModelConfig), "
            "--help=<argument> (e.g. max-num-seqs), --help=<keyword> (e.g. max) or "
            "--help=listgroup."
        ),
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=argparse.SUPPRESS,
        help="The model to serve: the same as --model (giving both with different values is an error).",
    )
    parser.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        metavar="FILE.yaml",
        help="Read options from a YAML file whose keys are long option names without dashes "
        "(snake or kebab case); options on the command line win.",
    )
    add_engine_arguments(parser, frontend=frontend, defaults=defaults)
    return parser
