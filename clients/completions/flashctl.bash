# bash completion for flashctl; source it, or install it as
# /usr/share/bash-completion/completions/flashctl.
_flashctl() {
  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
  local commands="status models metrics cache sessions tokens pin-repo top bench"
  local i command=""
  for ((i = 1; i < COMP_CWORD; i++)); do
    case ${COMP_WORDS[i]} in
      --socket|--url|--key) ((i++)) ;;
      -*) ;;
      *) command=${COMP_WORDS[i]}; break ;;
    esac
  done
  case $prev in
    --socket|--file|--files) COMPREPLY=($(compgen -f -- "$cur")); return ;;
    --url|--key|--text|--name|--group|--turn|--tokens|--interval|--wait) return ;;
  esac
  case $command in
    "") COMPREPLY=($(compgen -W "$commands --socket --url --key --json --help" -- "$cur")) ;;
    cache) COMPREPLY=($(compgen -W "stats ls pins pin unpin evict --text --file --files --group --json" -- "$cur")) ;;
    sessions) COMPREPLY=($(compgen -W "ls show rm fork --turn --json" -- "$cur")) ;;
    tokens) COMPREPLY=($(compgen -f -- "$cur")) ;;
    pin-repo) COMPREPLY=($(compgen -d -- "$cur") $(compgen -W "--name --json" -- "$cur")) ;;
    status) COMPREPLY=($(compgen -W "--wait --json" -- "$cur")) ;;
    top) COMPREPLY=($(compgen -W "--once --interval --json" -- "$cur")) ;;
    bench) COMPREPLY=($(compgen -W "--tokens --json" -- "$cur")) ;;
    *) COMPREPLY=($(compgen -W "--json" -- "$cur")) ;;
  esac
}
complete -F _flashctl flashctl
