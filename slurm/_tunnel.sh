# Sourced by jupyter.sbatch, tensorboard.sbatch and mlflow.sbatch (not a job script): environment, a free port, a
# private log, where the server listens, and the SSH tunnel instructions for a web server on the compute node.
#   ACTIVATE     command that activates the environment (default: source .venv/bin/activate when it exists)
#   LOGIN_HOST   the host you ssh into (default: the host the job was submitted from)
#   TUNNEL_USER  your user name there (default: $USER)
#   TUNNEL_NODE  the compute node's name as seen from the login host (default: this node's hostname)
#   TUNNEL_VIA   node: the server listens on 127.0.0.1 of the compute node only, and the tunnel is an ssh session
#                      into the node through the login host (ssh -J); needs ssh to nodes where you have a job.
#                login: the server listens on all the node's interfaces, and the tunnel goes from the login host to
#                      the node's port; works without ssh to nodes, but anyone who can reach the node can connect.
#                (default: each job script's own; slurm/README.md says who can reach what)

activate_env() {
  if [ -n "${ACTIVATE:-}" ]; then eval "$ACTIVATE"
  elif [ -x .venv/bin/python ]; then source .venv/bin/activate
  fi
}

# A random free TCP port in 20000-60999 (random, so that two users on one node rarely race for the same one).
free_port() {
  "$(command -v python || command -v python3)" - <<'EOF'
import random, socket
for _ in range(200):
    port = random.randint(20000, 60999)
    with socket.socket() as s:
        try: s.bind(('', port))
        except OSError: continue
    print(port); break
else: raise SystemExit('no free port found in 20000-60999')
EOF
}

# Make the job's log files readable by the user alone (they are about to hold a secret) and keep new files private.
private_log() {
  # The files are found through the batch script's own stdout and stderr (/proc/$$/fd/1 and 2), so paths with spaces
  # work and scontrol is not needed. Fails closed: returns 1 when a log cannot be made private (NOT_PRIVATE then
  # names it), and the caller must then not print secrets into it.
  umask 077
  local fd f ok=0
  NOT_PRIVATE=
  for fd in 1 2; do
    f=$(readlink "/proc/$$/fd/$fd" 2>/dev/null) || { ok=1; NOT_PRIVATE="fd $fd"; continue; }
    [ "$f" = /dev/null ] && continue
    if [ -f "$f" ]; then
      chmod 600 "$f" 2>/dev/null || true; [ "$(stat -c %a "$f" 2>/dev/null)" = 600 ] || { ok=1; NOT_PRIVATE=$f; }
    elif [[ "$f" != pipe:* && "$f" != socket:* && ! -c "$f" ]]; then ok=1; NOT_PRIVATE=$f   # (a pipe or terminal is no file others read)
    fi
  done
  return $ok
}

# tunnel_mode DEFAULT_VIA: sets TUNNEL_VIA (the user's choice, else DEFAULT_VIA) and LISTEN, the address the server
# must listen on: 127.0.0.1 for `node`, 0.0.0.0 (every interface) for `login`. Another value stops the job.
tunnel_mode() {
  TUNNEL_VIA=${TUNNEL_VIA:-$1}
  case "$TUNNEL_VIA" in
    node) LISTEN=127.0.0.1 ;;
    login) LISTEN=0.0.0.0 ;;
    *) echo "TUNNEL_VIA=$TUNNEL_VIA: use TUNNEL_VIA=node (listen on the node's 127.0.0.1, tunnel with ssh -J through" \
            "the login host) or TUNNEL_VIA=login (listen on all the node's interfaces; see slurm/README.md)" >&2
       exit 2 ;;
  esac
}

# print_tunnel PORT URL_PATH [LOGIN]: the ssh command to run on your own machine (for TUNNEL_VIA), the URL to open, and
# who can connect (LOGIN says what the server asks of them; default: nothing).
print_tunnel() {
  local port=$1 path=${2:-/} auth=${3:-it has no login} node=${TUNNEL_NODE:-$(hostname)}
  local login=${LOGIN_HOST:-${SLURM_SUBMIT_HOST:-LOGIN_HOST}} user=${TUNNEL_USER:-${USER:-$(id -un)}} ssh where
  if [ "$TUNNEL_VIA" = node ]; then
    ssh="ssh -N -L localhost:$port:127.0.0.1:$port -J $user@$login $user@$node"
    where="It listens on 127.0.0.1 of $node only ($auth): processes on $node can connect, nothing from elsewhere.
The tunnel logs into $node through $login, which needs ssh to nodes where you have a job; if your site
refuses that, resubmit with TUNNEL_VIA=login (then anyone who can reach $node can connect; see slurm/README.md)."
  else
    ssh="ssh -N -L localhost:$port:$node:$port $user@$login"
    where="It listens on all interfaces of $node ($auth): anyone who can reach $node over the network can connect."
  fi
  cat <<EOF
================================================================================
$SLURM_JOB_NAME (job $SLURM_JOB_ID) on node $node, port $port.
On your own machine run (and keep it open):

    $ssh

then open:

    http://localhost:$port$path

$where
Stop it with: scancel $SLURM_JOB_ID
================================================================================
EOF
}
