# Sourced first by every script here: -h or --help prints the script's header comment and exits 0 before
# anything runs (most scripts take no flags, and would otherwise start their experiment).
for _arg in "$@"; do
    case $_arg in
        -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    esac
done
