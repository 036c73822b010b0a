"""Run a docs page's commands in order in this one process, as a shell would run them one after another:
`python script.py ARGS` through runpy (the script as __main__, sys.argv and sys.path[0] as Python sets them),
any other command (make, bash) as a child process. Saves one interpreter start-up (torch's import, seconds)
per command. Usage: python docs_runner.py COMMANDS.json RESULTS.json, COMMANDS a list of [env, words]."""
import contextlib
import io
import json
import os
import runpy
import subprocess
import sys


def run_one(env, words):
    os.environ.update(env)
    if words[0] == sys.executable and len(words) > 1 and words[1].endswith(".py"):
        script = os.path.abspath(words[1])
        err = io.StringIO()
        saved = sys.argv, sys.path[0]
        sys.argv, sys.path[0] = words[1:], os.path.dirname(script)
        code = 0
        try:
            with contextlib.redirect_stderr(err):
                runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:   # what a child process would have printed as a traceback
            import traceback
            err.write("Traceback (most recent call last):\n" + "".join(traceback.format_exception(e)))
            code = 1
        finally:
            sys.argv, sys.path[0] = saved
        return code, err.getvalue()
    done = subprocess.run(words, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    return done.returncode, done.stderr


def main():
    with open(sys.argv[1]) as f:
        commands = json.load(f)
    results = []
    for env, words in commands:
        code, err = run_one(env, words)
        results.append({"returncode": code, "stderr": err})
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
        if code != 0 and not (code == 2 and words[0] == "make"):
            break   # later steps build on this one


if __name__ == "__main__":
    main()
